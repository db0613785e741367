"""`QuantConfig`, the FP4 recipe of a run (formats per site kind, guided layers), and the three
decisions it rests on, each with one home here:

* the quantization sites: a registry from site name to `SiteKind` (weight, activation, KV);
  a model that adds an FP4 site registers it with `register_site`;
* the named FP4 recipes ("nvfp4", "mxfp4_w4a4", "mxfp4_w4a8"): a registry of `QuantConfig`
  factories, `register_recipe` / `quant_recipe`;
* which layers are guided: `resolve_layers(spec, n_layers)`, where a spec is "all" | "half" |
  "quarter" | "eighth" (the deepest fraction of the layers), a comma list "0,3", or a sequence of
  layer indices.

Site keys ("<layer>/<name>", `site_key`) name one site of one layer in capture, guidance and
statistics dicts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence

from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, GuidanceMode


class SiteMode(enum.StrEnum):
    """How a forward pass treats the quantization sites."""

    OFF = "off"  # bf16 everywhere (the BF16 rollout and trainer)
    RTN = "rtn"  # FP4 with own scales, round to nearest (the FP4 rollout; vanilla FP4 QAT)
    GUIDED = "guided"  # trainer: guided layers follow the rollout's guidance, others RTN


class SiteKind(enum.StrEnum):
    """What a quantization site quantizes; the kind picks the site's format in a `QuantConfig`."""

    WEIGHT = "weight"  # routed-expert weight matrices
    ACTIVATION = "activation"  # activations entering an FP4 matmul
    KV = "kv"  # keys and values of the KV cache

    @property
    def guidable(self) -> bool:
        """Whether the rollout's rounding at such a site can be captured and replayed; weights
        are quantized identically on both sides, so there is nothing to replay."""
        return self is not SiteKind.WEIGHT


# Site name -> kind, in registration order (which orders `guided_keys` and the site views).
SITES: dict[str, SiteKind] = {}


def register_site(name: str, kind: SiteKind | str, *, replace: bool = False) -> None:
    """Registers the quantization site `name` (what the model passes as `name=` to its site hook)
    as a `kind` site ("weight" | "activation" | "kv"); its format is then `QuantConfig`'s format of
    that kind, and activation/KV sites can carry guidance.

    Raises ValueError on a bad name or kind, or when `name` is registered and not `replace`.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"a site name is a non-empty string without '/'; got {name!r}")
    try:
        kind = SiteKind(kind)
    except ValueError:
        raise ValueError(
            f"site kind must be one of {[k.value for k in SiteKind]}; got {kind!r}"
        ) from None
    if name in SITES and not replace:
        raise ValueError(
            f"quantization site {name!r} is already registered (as {SITES[name].value!r}); "
            "pass replace=True to redefine it"
        )
    SITES[name] = kind


def site_kind(name: str) -> SiteKind:
    """The kind of the registered site `name`."""
    if name not in SITES:
        raise ValueError(f"unknown quantization site {name!r}; expected one of {list(SITES)}")
    return SITES[name]


class SiteNames(Sequence[str]):
    """The registered site names of some kinds, in registration order: a live view of `SITES`,
    so `name in WEIGHT_SITES` sees sites registered after import."""

    def __init__(self, *kinds: SiteKind):
        self._kinds = frozenset(kinds)

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, k in SITES.items() if k in self._kinds)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and SITES.get(name) in self._kinds

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())


WEIGHT_SITES = SiteNames(SiteKind.WEIGHT)
ACTIVATION_SITES = SiteNames(SiteKind.ACTIVATION)
KV_SITES = SiteNames(SiteKind.KV)
GUIDABLE_SITES = SiteNames(*(k for k in SiteKind if k.guidable))

# The sites of the Qwen3-MoE model (`trace_jax.models.SiteName`).
for _name, _kind in {
    "w_gate": SiteKind.WEIGHT,
    "w_up": SiteKind.WEIGHT,
    "w_down": SiteKind.WEIGHT,
    "expert_in": SiteKind.ACTIVATION,
    "expert_mid": SiteKind.ACTIVATION,
    "k": SiteKind.KV,
    "v": SiteKind.KV,
}.items():
    register_site(_name, _kind)
del _name, _kind


def site_key(layer: int, name: str) -> str:
    """The key of one site in guidance, capture and statistics dicts: "<layer>/<name>"."""
    return f"{layer}/{name}"


def parse_site_key(key: str) -> tuple[int, str]:
    """`(layer, name)` of a site key "<layer>/<name>" (the inverse of `site_key`)."""
    layer, sep, name = key.partition("/") if isinstance(key, str) else ("", "", "")
    if not (sep and name and layer.isdigit()):
        raise ValueError(f"a site key is '<layer>/<name>', e.g. '3/expert_in'; got {key!r}")
    return int(layer), name


# Fraction name -> d: the spec names the deepest ceil(n_layers / d) layers.
LAYER_FRACTIONS: dict[str, int] = {"all": 1, "half": 2, "quarter": 4, "eighth": 8}

LayerSpec = str | Sequence[int]


def parse_layer_spec(spec: LayerSpec) -> str | tuple[int, ...]:
    """The canonical form of a guided-layer spec, before the model depth is known: a fraction
    name stays a name; a comma list ("0,3") or a sequence of ints becomes a sorted tuple of
    distinct non-negative layer indices (empty: no layer is guided)."""
    if isinstance(spec, str):
        if spec.strip() in LAYER_FRACTIONS:
            return spec.strip()
        try:
            layers = [int(s) for s in spec.split(",")]
        except ValueError:
            raise ValueError(
                f"guided layers must be one of {list(LAYER_FRACTIONS)}, a comma list of layer "
                f"indices such as '0,3', or a sequence of ints; got {spec!r}"
            ) from None
    elif isinstance(spec, Iterable) and not isinstance(spec, bytes):
        layers = list(spec)
        try:
            if any(isinstance(i, bool) for i in layers):
                raise TypeError
            layers = [operator.index(i) for i in layers]
        except TypeError:
            raise ValueError(f"guided layers must be ints; got {spec!r}") from None
    else:
        raise ValueError(
            f"guided layers must be one of {list(LAYER_FRACTIONS)}, a comma list of layer "
            f"indices, or a sequence of ints; got {spec!r}"
        )
    negative = [i for i in layers if i < 0]
    if negative:
        raise ValueError(f"guided layers must be >= 0; got {negative} in {spec!r}")
    return tuple(sorted(set(layers)))


def resolve_layers(spec: LayerSpec, n_layers: int) -> tuple[int, ...]:
    """The guided layers that `spec` names in an `n_layers` model, ascending.

    A fraction name gives the deepest `ceil(n_layers / d)` layers ("half" of 5 layers: 2, 3, 4;
    "eighth" of 4: 3), so at least one; explicit indices must lie in `[0, n_layers)`.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be an int >= 1; got {n_layers!r}")
    spec = parse_layer_spec(spec)
    if isinstance(spec, str):
        count = -(-n_layers // LAYER_FRACTIONS[spec])
        return tuple(range(n_layers - count, n_layers))
    bad = [i for i in spec if i >= n_layers]
    if bad:
        raise ValueError(
            f"guided layers {bad} out of range for a {n_layers}-layer model "
            f"(expected 0..{n_layers - 1})"
        )
    return spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Formats of the routed-expert weights and activations and of the KV cache.

    Attributes:
      weight_format: weight sites (None: bf16). NVFP4 weights get one global scale per expert
        matrix.
      activation_format: activation sites ("mxfp8" gives W4A8).
      kv_format: K and V per token and head (None: bf16 KV cache).
      guided_layers: layers whose activation/KV sites carry guidance, as a spec of
        `resolve_layers` ("half": the deeper half); held in `parse_layer_spec`'s canonical form.
      guidance_mode: "compact" (1 bit/element + scales) or "full" (codes + scales).
      weights_prequantized: the expert weights already hold FP4 values (post-training
        quantization, `trace_jax.quant.ptq`): weight sites pass them through unchanged.
    """

    weight_format: str | None = "nvfp4"
    activation_format: str | None = "nvfp4"
    kv_format: str | None = "nvfp4"
    guided_layers: str | tuple[int, ...] = "half"
    guidance_mode: GuidanceMode = GuidanceMode.COMPACT
    weights_prequantized: bool = False

    def __post_init__(self):
        for name in ("weight_format", "activation_format", "kv_format"):
            value = getattr(self, name)
            if value is not None:
                fp4.get_format(value)  # raises on an unknown format
        if self.weight_format is not None and not fp4.get_format(self.weight_format).is_fp4:
            raise ValueError(f"weights are FP4 here; got weight_format={self.weight_format!r}")
        object.__setattr__(self, "guidance_mode", GuidanceMode(self.guidance_mode))
        object.__setattr__(self, "guided_layers", parse_layer_spec(self.guided_layers))

    @classmethod
    def nvfp4(cls, **overrides) -> QuantConfig:
        """The "nvfp4" recipe: NVFP4 weights, activations and KV cache (the paper's main
        setting)."""
        return quant_recipe("nvfp4", **overrides)

    @classmethod
    def mxfp4_w4a4(cls, **overrides) -> QuantConfig:
        """The "mxfp4_w4a4" recipe."""
        return quant_recipe("mxfp4_w4a4", **overrides)

    @classmethod
    def mxfp4_w4a8(cls, **overrides) -> QuantConfig:
        """The "mxfp4_w4a8" recipe."""
        return quant_recipe("mxfp4_w4a8", **overrides)

    @classmethod
    def bf16(cls) -> QuantConfig:
        """No quantization at any site."""
        return cls(weight_format=None, activation_format=None, kv_format=None)

    def format_for(self, site: str) -> BlockFormat | None:
        """The format of the registered site `site` (None: that site stays bf16)."""
        name = {
            SiteKind.WEIGHT: self.weight_format,
            SiteKind.ACTIVATION: self.activation_format,
            SiteKind.KV: self.kv_format,
        }[site_kind(site)]
        return None if name is None else fp4.get_format(name)

    def layers_guided(self, n_layers: int) -> tuple[int, ...]:
        """The guided layers of an `n_layers` model (`resolve_layers(guided_layers, n_layers)`)."""
        return resolve_layers(self.guided_layers, n_layers)

    def guided_keys(self, n_layers: int) -> tuple[str, ...]:
        """Site keys ("layer/name") that carry guidance in this recipe."""
        return self._quantized_keys(self.layers_guided(n_layers))

    def all_keys(self, n_layers: int) -> tuple[str, ...]:
        """Every quantized guidable site key, all layers (for diagnostics)."""
        return self._quantized_keys(range(n_layers))

    def _quantized_keys(self, layers: Iterable[int]) -> tuple[str, ...]:
        sites = [s for s in GUIDABLE_SITES if self.format_for(s) is not None]
        return tuple(site_key(layer, s) for layer in layers for s in sites)


# Recipe name -> factory: `factory(**overrides)` returns the recipe's `QuantConfig` with those
# fields overridden.
QUANT_RECIPES: dict[str, Callable[..., QuantConfig]] = {}


def register_recipe(
    name: str, factory: Callable[..., QuantConfig], *, replace: bool = False
) -> None:
    """Registers the FP4 recipe `name`: `factory(**overrides)` makes its `QuantConfig` (e.g.
    `functools.partial(QuantConfig, weight_format="mxfp4", ...)`). The factory is called once
    here, so a broken recipe fails at registration.

    Raises ValueError when `name` is registered and not `replace`, TypeError when `factory()` is
    not a `QuantConfig`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a recipe name is a non-empty string; got {name!r}")
    if name in QUANT_RECIPES and not replace:
        raise ValueError(
            f"FP4 recipe {name!r} is already registered; pass replace=True to redefine it"
        )
    made = factory()
    if not isinstance(made, QuantConfig):
        raise TypeError(f"recipe {name!r}: factory() must return a QuantConfig; got {made!r}")
    QUANT_RECIPES[name] = factory


def quant_recipe(name: str, **overrides) -> QuantConfig:
    """The `QuantConfig` of the FP4 recipe `name`, with field overrides."""
    if name not in QUANT_RECIPES:
        raise ValueError(f"unknown FP4 recipe {name!r}; expected one of {sorted(QUANT_RECIPES)}")
    return QUANT_RECIPES[name](**overrides)


def _formats(weight: str, activation: str, kv: str) -> Callable[..., QuantConfig]:
    return functools.partial(
        QuantConfig, weight_format=weight, activation_format=activation, kv_format=kv
    )


register_recipe("nvfp4", _formats("nvfp4", "nvfp4", "nvfp4"))
register_recipe("mxfp4_w4a4", _formats("mxfp4", "mxfp4", "mxfp4"))
register_recipe("mxfp4_w4a8", _formats("mxfp4", "mxfp8", "mxfp4"))
