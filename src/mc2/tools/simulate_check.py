"""``mc2 simulate --calibrate``: the model checked against this machine's measured runs.

The planner's calibration (link latency and bandwidth, expert compute, interference, row
bookkeeping) describes this machine's Gloo world; the same pipeline model then predicts the
serial and MC2 step times that ``mc2 bench`` measures, configuration by configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from mc2.tools.bench import BenchConfig, run_bench

# (world size, tokens per rank): each is measured serial and with K = 2 and 4
CONFIGS = ((2, 512), (2, 2048), (4, 512))


@dataclass(frozen=True)
class Check:
    world: int
    tokens: int
    mode: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def validate(hidden: int = 1024, ffn: int = 2048, repeats: int = 5,
             configs: tuple[tuple[int, int], ...] = CONFIGS) -> tuple[list[Check], list[str]]:
    """Predicted vs measured for every configuration, and the best-K verdict per problem."""
    checks, verdicts = [], []
    for world, tokens in configs:
        cfg = BenchConfig(tokens_per_rank=tokens, hidden=hidden, ffn=ffn, micro_batches=(2, 4),
                          repeats=repeats, auto=True, quiet=True)
        report = run_bench(cfg, world_size=world)
        measured = {1: report.serial.step_s,
                    **{k: report.result(f"mc2 K={k}").step_s for k in (2, 4)}}
        predicted = {1: report.predicted_serial_s, **{k: report.predicted_s[k] for k in (2, 4)}}
        checks += [Check(world, tokens, "serial" if k == 1 else f"mc2 K={k}", predicted[k],
                         measured[k]) for k in measured]
        pk = min(predicted, key=predicted.__getitem__)
        mk = min(measured, key=measured.__getitem__)
        close = measured[pk] / measured[mk] - 1
        verdicts.append(f"{world} ranks x {tokens} tokens: predicted best K={pk}, measured best "
                        f"K={mk}; the predicted K runs {close * 100:+.1f}% from the best "
                        f"({'ok' if pk == mk or close <= 0.05 else 'MISS'})")
    return checks, verdicts


def format_checks(checks: list[Check], verdicts: list[str]) -> str:
    lines = ["ranks  tokens/rank  mode       predicted ms  measured ms   error"]
    for c in checks:
        lines.append(f"{c.world:5d}  {c.tokens:11d}  {c.mode:<9} {c.predicted_s * 1e3:12.1f} "
                     f"{c.measured_s * 1e3:12.1f}  {c.error * 100:+6.1f}%")
    worst = max(abs(c.error) for c in checks)
    lines.append(f"largest error {worst * 100:.1f}% "
                 f"({'all within 20%' if worst <= 0.2 else 'some beyond 20%'})")
    return "\n".join(lines + verdicts)
