"""One capture of the whole model's computation, the graph that placement is decided on.

:func:`capture` runs the model once on a sample and records, for every module that ran, the graph of its own
forward as it executed (:mod:`lq.capture._record`); :func:`call_key` names the calls the way both the capture
and the run-time quantizers (:mod:`lq.glue._at_calls`) count them. Nothing here knows about quantization.
"""

from lq.capture._keys import call_key, in_place
from lq.capture._record import LAYER_FUNCTIONS, Capture, Constant, capture

__all__ = ["Capture", "Constant", "LAYER_FUNCTIONS", "call_key", "capture", "in_place"]
