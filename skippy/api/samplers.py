"""llama.cpp's ``samplers`` field (the order its samplers run in) mapped onto skippy's sampler chain.

Strategy: skippy's final stage runs a fixed chain (skippy/runtime/sampling.py): logit bias,
``penalties``, grammar, then ``top_k``, ``top_p``, ``min_p``, ``temperature`` and the draw.  A
``samplers`` list (llama-server's names and aliases, or its string of sampler characters, e.g.
``"kpmt"``) is served where that chain can run it exactly:

* a served sampler the list leaves out is not applied, as in llama.cpp: its parameter becomes the
  neutral value (``top_k`` 0, ``top_p`` 1, ``min_p`` 0, penalties off; no ``temperature``: the
  draw from the unscaled distribution, temperature 1);
* the samplers skippy does not run (``dry``, ``top_n_sigma``, ``typ_p``, ``xtc``) are identities
  at their neutral parameters, which are the only ones skippy accepts, so naming them changes nothing;
* the active samplers (parameter not neutral) must come in skippy's order, each once; another
  order, or a sampler with no neutral form (``infill``, ``adaptive_p``), is a 400 naming ``samplers``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from skippy.api.errors import invalid
from skippy.api.fields import unsupported
from skippy.runtime.sampling import SamplingParams

__all__ = ["ORDER", "apply_samplers"]

#: skippy's chain order of the samplers it runs.
ORDER: Final = ("penalties", "top_k", "top_p", "min_p", "temperature")
#: llama.cpp samplers skippy does not run; identities at the parameters skippy accepts.
_IDENTITIES: Final = ("dry", "top_n_sigma", "typ_p", "xtc")
_REFUSED: Final = ("infill", "adaptive_p")
_CHARS: Final = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}


def _names() -> dict[str, str]:
    """llama.cpp's names: canonical, kebab-case, without underscores, and its other aliases."""
    out = {}
    for name in (*ORDER, *_IDENTITIES, *_REFUSED):
        out[name] = name
        out[name.replace("_", "-")] = name
        out[name.replace("_", "")] = name
    out.update({"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"})
    return out


_NAMES: Final = _names()


def _parse(value: Any) -> list[str]:
    if isinstance(value, str):
        unknown = sorted({char for char in value if char not in _CHARS})
        if unknown:
            raise invalid("samplers", f"unknown sampler characters {''.join(unknown)!r} (llama.cpp's: "
                          f"{''.join(_CHARS)})")
        return [_CHARS[char] for char in value]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise invalid("samplers", "expected a list of sampler names or a string of sampler characters")
    unknown = [name for name in value if name not in _NAMES]
    if unknown:
        known = ", ".join(sorted(set(_NAMES.values())))
        raise invalid("samplers", f"unknown sampler {unknown[0]!r} (llama.cpp's: {known})")
    return [_NAMES[name] for name in value]


def _active(params: SamplingParams, name: str) -> bool:
    if name == "penalties":
        return params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    if name == "top_k":
        return params.top_k > 0
    if name == "top_p":
        return params.top_p < 1.0
    if name == "min_p":
        return params.min_p > 0.0
    return params.temperature != 1.0  # temperature


_NEUTRAL: Final = {"penalties": {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
                   "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0}, "min_p": {"min_p": 0.0},
                   "temperature": {"temperature": 1.0}}


def apply_samplers(value: Any, params: SamplingParams) -> SamplingParams:
    """The sampling parameters a ``samplers`` list leaves (see the module header).

    Raises:
        ApiError: a malformed list (422), or an order / sampler skippy's chain cannot run (400).
    """
    names = _parse(value)
    refused = [name for name in names if name in _REFUSED]
    if refused:
        raise unsupported("samplers", f"the {refused[0]} sampler is not served (skippy's chain: "
                          f"{', '.join(ORDER)})")
    for name in ORDER:
        if name not in names:
            params = dataclasses.replace(params, **_NEUTRAL[name])  # type: ignore[arg-type]
    active = [name for name in names if name in ORDER and _active(params, name)]
    if len(set(active)) != len(active):
        raise unsupported("samplers", "a sampler named twice is not served (skippy's chain runs each once)")
    if [ORDER.index(name) for name in active] != sorted(ORDER.index(name) for name in active):
        raise unsupported("samplers", f"skippy's final stage applies its samplers in the order "
                          f"{', '.join(ORDER)}; {', '.join(active)} (the active ones, in the order asked) "
                          "cannot be served")
    return params
