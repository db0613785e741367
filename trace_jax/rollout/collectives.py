"""The collectives of a compiled rollout on a mesh, read from its HLO text.

A data-parallel rollout needs no data from other devices but for the decode loop's "every row
finished" test; every other collective the partitioner inserts is traffic per layer and per
decode step that a second GPU pays for. `rollout_collectives` compiles `generate` for the context
mesh and lists each collective instruction (all-gather, all-reduce, reduce-scatter,
collective-permute, all-to-all; an async pair counted once, by its start) with the op name JAX
gave it. The sampler's named scopes (`PREFILL_SCOPE`, `DECODE_SCOPE`) and the model's
(`layer_<i>/attention`, `layer_<i>/moe`) place it: `collective_counts` counts a decode step's
(the loop's body and test, run once a step), the prefill's, and the rest, per layer and block
part.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from trace_jax.rollout.sampler import DECODE_SCOPE, PREFILL_SCOPE, generate

COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
# An instruction `%name = shape op(...)` or its async `op-start(...)` (its `-done` not counted).
_COLLECTIVE = re.compile(r"=.*?\b(" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYER_PART = re.compile(r"/layer_(\d+)/(attention|moe)/")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program: its op ("all-gather", ...) and the op
    name of the JAX operation it came from ("" where the HLO has none)."""

    op: str
    op_name: str

    @property
    def region(self) -> str:
        """ "decode" (the decode loop: once a decode step), "prefill" or "other"."""
        if f"/{DECODE_SCOPE}/" in self.op_name:
            return "decode"
        if f"/{PREFILL_SCOPE}/" in self.op_name:
            return "prefill"
        return "other"

    @property
    def layer_part(self) -> tuple[int, str] | None:
        """(layer, "attention" or "moe") of a collective inside a decoder block, else None."""
        m = _LAYER_PART.search(self.op_name)
        return None if m is None else (int(m.group(1)), m.group(2))


def hlo_collectives(text: str) -> list[Collective]:
    """The collective instructions of compiled HLO `text` (`compiled.as_text()`), in order."""
    found = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            name = _OP_NAME.search(line)
            found.append(Collective(m.group(1), name.group(1) if name else ""))
    return found


def rollout_collectives(graphdef, params, prompts, prompt_lengths, key, **kw) -> list[Collective]:
    """The collectives of `generate(graphdef, params, prompts, prompt_lengths, key, **kw)`
    compiled for the context mesh (`jax.set_mesh`) and the arguments' placements; nothing
    runs."""
    compiled = generate.lower(graphdef, params, prompts, prompt_lengths, key, **kw).compile()
    return hlo_collectives(compiled.as_text())


def _by_op(found: list[Collective]) -> str:
    """ "all-gather 2, all-reduce 1" (ops in `COLLECTIVE_OPS` order), or "none"."""
    n = collections.Counter(c.op for c in found)
    return ", ".join(f"{op} {n[op]}" for op in COLLECTIVE_OPS if n[op]) or "none"


def collective_counts(found: list[Collective], n_layers: int) -> dict[str, int | float | str]:
    """Counts of a compiled rollout's collectives (`rollout_collectives`).

    decode_step: the decode loop's (body and test), run once a decode step; of them
    decode_moe, decode_attention (inside a block's MoE or attention), decode_other (sampling,
    the loop's test, ...), and decode_moe_per_layer = decode_moe / `n_layers`; decode_ops: the
    step's by op. prefill: the prefill's (once a prefill chunk), prefill_moe of them. other:
    the rest (the first sample, the records' writes after the loop).
    """
    decode = [c for c in found if c.region == "decode"]
    prefill = [c for c in found if c.region == "prefill"]

    def part(cs, name):
        return sum(1 for c in cs if c.layer_part is not None and c.layer_part[1] == name)

    decode_moe = part(decode, "moe")
    return {
        "decode_step": len(decode),
        "decode_moe": decode_moe,
        "decode_attention": part(decode, "attention"),
        "decode_other": sum(1 for c in decode if c.layer_part is None),
        "decode_moe_per_layer": decode_moe / n_layers,
        "decode_ops": _by_op(decode),
        "prefill": len(prefill),
        "prefill_moe": part(prefill, "moe"),
        "other": len(found) - len(decode) - len(prefill),
    }
