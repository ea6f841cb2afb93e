"""Parameter selection by name for optimizers, and in-place weight quantization (``pytorch_quantization.optim.helper``).

Fine-tuning a quantized model often wants other optimizer settings for some
parameters (learned amax, the first conv, the classifier): these helpers pick
parameters by regular expressions on their names (``re.search``, so a pattern
matches anywhere in the name) and build the per-parameter-group list that
``torch.optim`` optimizers take.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["match_parameters", "group_parameters", "freeze_parameters", "quant_weight_inplace"]

logger = logging.getLogger(__name__)


def _matching(model: nn.Module, patterns: Sequence[str]) -> Iterator[tuple[str, nn.Parameter]]:
    compiled = [re.compile(p) for p in patterns]
    for name, param in model.named_parameters():
        if any(c.search(name) for c in compiled):
            yield name, param


def match_parameters(model: nn.Module, patterns: Sequence[str]) -> Iterator[nn.Parameter]:
    """Yield each parameter of ``model`` whose name matches any of ``patterns`` (once, however many match)."""
    for _, param in _matching(model, patterns):
        yield param


def _check_per_group(values, what: str, n_groups: int) -> None:
    if values is not None and len(values) != n_groups:
        raise TypeError(f"group_parameters: {what} has {len(values)} value(s) for {n_groups} group(s); "
                        f"len({what}) must match len(patterns_list)")


def group_parameters(model: nn.Module, patterns_list, lrs=None, momentums=None, weight_decays=None) -> list[dict]:
    """Parameter groups for a ``torch.optim`` optimizer, one per list of patterns in ``patterns_list``.

    ``group_parameters(model, [["conv1"], ["fc", "_amax"]], lrs=[0.01, 0.001])``
    gives ``[{"params": [...], "lr": 0.01}, {"params": [...], "lr": 0.001}]``.
    ``lrs``, ``momentums`` and ``weight_decays``, when given, hold one value per
    group. A parameter matched by two groups is an error (an optimizer would
    reject it later, without saying which patterns overlap). Parameters no
    group matches are not in the result.
    """
    if isinstance(patterns_list, (str, bytes)) or not isinstance(patterns_list, (list, tuple)):
        raise TypeError(f"group_parameters: patterns_list must be list of list of patterns, got {patterns_list!r}")
    for i, patterns in enumerate(patterns_list):
        if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
            raise TypeError("group_parameters: patterns_list must be list of list of patterns (regular expressions); "
                            f"item {i} is {patterns!r}")
    for values, what in ((lrs, "lrs"), (momentums, "momentums"), (weight_decays, "weight_decays")):
        _check_per_group(values, what, len(patterns_list))

    groups, owner = [], {}
    for i, patterns in enumerate(patterns_list):
        params = []
        for name, param in _matching(model, patterns):
            if id(param) in owner:
                raise ValueError(f"group_parameters: parameter {name!r} matches group {owner[id(param)]} and group "
                                 f"{i}; the groups' patterns must not overlap")
            owner[id(param)] = i
            params.append(param)
        groups.append({"params": params})
    for values, key in ((lrs, "lr"), (momentums, "momentum"), (weight_decays, "weight_decay")):
        for group, value in zip(groups, values or ()):
            group[key] = value
    return groups


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter whose name matches any of ``patterns``; returns their names."""
    names = []
    for name, param in _matching(model, patterns):
        param.requires_grad_(False)
        names.append(name)
    logger.info("Froze %d parameter(s): %s", len(names), ", ".join(names))
    return names


@torch.no_grad()
def quant_weight_inplace(model: nn.Module) -> list[str]:
    """Overwrite every quantized module's weights with their quantized values (what its weight quantizer returns).

    Used for relax-and-round style training, or to store weights that are
    already on the grid. Weights a module quantizes as a derived tensor (the
    LSTM's ``[W_ih | W_hh]``) are left as they are, with a warning. Returns
    the names of the weights overwritten.
    """
    done, seen, derived = [], set(), []
    param_names = {id(p): n for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        pairs = getattr(module, "weight_quantizer_pairs", None)
        if pairs is None:
            continue
        for quantizer, weight in pairs():
            if id(weight) in seen:
                continue
            seen.add(id(weight))
            if id(weight) not in param_names:
                derived.append(name)
                continue
            if not quantizer.fake_quant:
                logger.warning("%s: its weight quantizer does real quantization (fake_quant=False): the weight now "
                               "holds integers, for inference only", name)
            weight.copy_(quantizer(weight))
            done.append(param_names[id(weight)])
    if derived:
        logger.warning("Weights quantized as a derived tensor were left unchanged in: %s", ", ".join(sorted(set(derived))))
    return done
