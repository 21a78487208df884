"""The reviewer's head (:mod:`specialists.review`): written by ``python -m bench.review --train``
from the labelled traces of :mod:`bench.loop_traces`; a test checks that training again
makes the same head."""

WEIGHTS = (-1.545, -0.791, -7.168, 2.125, 1.516, -0.584, 1.125, -0.455, 0.125)
BIAS = 4.195
CONTINUE_BELOW = 0.2
STOP_ABOVE = 0.8
