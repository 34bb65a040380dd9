"""Fault injection for the engine (tests, and `--config.inject` in experiments).

`Engine.fault_injector` is a callable ``(point, scheduler_output) -> None`` that the
engine runs at ``"before_device"`` (after scheduling, before the step's inputs are
built) and ``"after_device"`` (after the device step returned) of every step that
runs the model; whatever it raises is handled as a failed model step (see
`Engine.step`). `StepFault` is such a callable; `parse_fault` builds one from a short
spec so a script can take it as a flag. Each injector keeps its own state (no
module-level state).
"""

from __future__ import annotations

from prefixcache._validate import check_count

POINTS = ("before_device", "after_device")
KINDS = ("error", "kv_lost", "interrupt")


class InjectedFault(RuntimeError):
    """The exception a `StepFault` raises (kind "error" / "kv_lost")."""


class StepFault:
    """Fails the engine's `step`-th model step (1-based, counted from attachment).

    Args:
      step: which model step fails.
      point: "before_device" or "after_device".
      kind: "error" (raise `InjectedFault`), "kv_lost" (delete the engine's KV arrays
        first, as a step that failed after taking the donated arrays would leave
        them, then raise) or "interrupt" (raise KeyboardInterrupt).
      engine: the engine whose KV arrays "kv_lost" deletes (`attach` sets it).

    Attributes:
      hit_request_ids: ids of the requests the failed step had scheduled (empty until
        it fired).
    """

    def __init__(self, step: int, *, point: str = "before_device", kind: str = "error",
                 engine=None):
        self.step = check_count("step", step, min=1)
        if point not in POINTS:
            raise ValueError(f"point must be one of {POINTS}, got {point!r}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.point, self.kind, self.engine = point, kind, engine
        self.num_steps = 0
        self.hit_request_ids: list[str] = []

    def attach(self, engine) -> "StepFault":
        """Installs this injector on `engine` (its `fault_injector`); returns self."""
        self.engine = engine
        engine.fault_injector = self
        return self

    @property
    def fired(self) -> bool:
        return self.num_steps >= self.step and bool(self.hit_request_ids)

    def __call__(self, point: str, sched) -> None:
        if point == "before_device":
            self.num_steps += 1
        if point != self.point or self.num_steps != self.step or self.hit_request_ids:
            return
        self.hit_request_ids = [s.request_id for s in sched.scheduled]
        if self.kind == "interrupt":
            raise KeyboardInterrupt(f"injected at model step {self.step} ({point})")
        if self.kind == "kv_lost":
            if self.engine is None:
                raise ValueError("a kv_lost fault needs the engine (StepFault.attach)")
            import jax  # noqa: PLC0415

            for x in jax.tree.leaves(self.engine.runner.kv_caches):
                x.delete()
        raise InjectedFault(f"injected fault at model step {self.step} ({point})")


def parse_fault(spec: str) -> StepFault | None:
    """A `StepFault` from ``"step:N[:point][:kind]"`` (e.g. ``"step:3"``,
    ``"step:3:after_device"``, ``"step:2:before_device:kv_lost"``); "" -> None.

    Raises:
      ValueError: naming the spec and the expected form (also two points or two kinds).
      TypeError: a spec that is not a str.
    """
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"fault spec must be a str, got {type(spec).__name__} {spec!r}")
    if not spec:
        return None
    parts = spec.split(":")
    form = "step:N[:before_device|after_device][:error|kv_lost|interrupt]"
    if parts[0] != "step" or not 2 <= len(parts) <= 4 or not parts[1].isdigit():
        raise ValueError(f"fault spec {spec!r} is not of the form {form}")
    kw = {}
    for p in parts[2:]:
        if p in POINTS:
            key = "point"
        elif p in KINDS:
            key = "kind"
        else:
            raise ValueError(f"fault spec {spec!r}: unknown part {p!r}; form {form}")
        if key in kw:  # "step:3:error:kv_lost": the last one would win silently
            raise ValueError(f"fault spec {spec!r}: conflicting {key}s {kw[key]!r} and "
                             f"{p!r}; give one; form {form}")
        kw[key] = p
    return StepFault(int(parts[1]), **kw)
