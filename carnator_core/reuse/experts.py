"""Two-expert models (Wan 2.2 A14B): which expert owns each step, and how a stretch of steps
splits at the boundary. Plain Python/torch; the adapter binds the experts to ComfyUI models.

Wan 2.2 A14B is run in ComfyUI as two KSamplerAdvanced nodes: the high-noise expert for steps
0..b-1 (returning its leftover noise), the low-noise expert for steps b..N-1 (adding none).
A step belongs to the expert that owns the sigma it *starts* from, so any stretch of steps
(a probe, a resume at k*, a coarse jump) is the same chain of segments, cut at b.
"""
from __future__ import annotations

from typing import Sequence

HIGH_NOISE, LOW_NOISE = "high_noise", "low_noise"
WAN22_SWITCH_SIGMA = 0.875  # Wan 2.2 T2V's boundary (timestep 875 of 1000)


def boundary_step(sigmas: Sequence[float], steps: int, switch_step: int = 0,
                  switch_sigma: float = WAN22_SWITCH_SIGMA) -> int:
    """The first step the low-noise expert runs.

    ``switch_step`` > 0 names it (KSamplerAdvanced's end_at_step / start_at_step); 0 takes the
    first step whose sigma is below ``switch_sigma``, as Wan 2.2's own sampler does. Either
    way both experts must run at least one step, or the pair is a mistake worth saying.
    """
    if switch_step:
        if not 1 <= int(switch_step) <= steps - 1:
            raise ValueError(f"switch_step {switch_step} is outside 1..{steps - 1} for {steps} steps: "
                             f"one expert would run every step. Set it between 1 and {steps - 1} "
                             "(the end_at_step of your first KSamplerAdvanced), or 0 to switch by sigma.")
        return int(switch_step)
    below = [i for i in range(steps) if float(sigmas[i]) < switch_sigma]
    b = below[0] if below else steps
    if not 1 <= b <= steps - 1:
        raise ValueError(f"switch_sigma {switch_sigma:g} puts all {steps} steps on the "
                         f"{'low' if b == 0 else 'high'}-noise expert (this schedule runs sigma "
                         f"{float(sigmas[0]):.3f} … {float(sigmas[steps - 1]):.3f}): choose a sigma "
                         "inside that range, or set switch_step.")
    return b


def segments(indices: Sequence[int], boundary: int) -> list[tuple[int, list[int]]]:
    """Split a path of step indices into (expert 0 or 1, its indices) runs.

    Each move from index a to the next belongs to the expert of a; consecutive runs share
    their junction index (the first run ends at it, the second starts there)."""
    out: list[tuple[int, list[int]]] = []
    for a, b in zip(indices, indices[1:]):
        expert = 0 if a < boundary else 1
        if out and out[-1][0] == expert:
            out[-1][1].append(int(b))
        else:
            out.append((expert, [int(a), int(b)]))
    return out
