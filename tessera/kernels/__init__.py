"""``tessera.kernels``: the op set beyond attention, one API over every backend.

Each public function validates its arguments (clear errors at the boundary) and dispatches through
:mod:`tessera.kernels.registry` to ``reference`` (float64), ``cpu`` or ``triton``; ``backend="auto"`` picks by device.
"""
