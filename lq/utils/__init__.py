"""Tensor helpers of the reference toolkit's ``utils`` package (``pytorch_quantization.utils``).

Code written against the reference toolkit (and its tests) computes expected
amax with :func:`reduce_amax`; the module layout (``utils.reduce_amax``)
follows the reference so its import paths work too.
"""

from lq.utils.reduce_amax import reduce_amax

__all__ = ["reduce_amax"]
