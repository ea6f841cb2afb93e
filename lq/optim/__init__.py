"""Optimizer helpers of the reference toolkit's ``optim`` package (``pytorch_quantization.optim``).

:mod:`lq.optim.helper` groups and freezes parameters by name pattern and
quantizes weights in place (:func:`~lq.optim.helper.quant_weight_inplace`).
"""

from lq.optim import helper  # noqa: F401
from lq.optim.helper import freeze_parameters, group_parameters, match_parameters, quant_weight_inplace

__all__ = ["helper", "match_parameters", "group_parameters", "freeze_parameters", "quant_weight_inplace"]
