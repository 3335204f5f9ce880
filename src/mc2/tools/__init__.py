"""The command line and what it runs: ``mc2 bench``, ``mc2 train``, ``mc2 doctor``, ...

``cli`` is the entry point; ``bench``, ``train``/``train_cli`` and ``doctor`` are its commands;
``launch`` starts local multi-process Gloo worlds (``mc2.run_local``); ``netns`` emulates nodes
in network namespaces joined by shaped links; ``requirements`` checks what a command needs
before it starts.
"""
