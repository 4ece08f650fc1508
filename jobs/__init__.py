"""The project's demo and main jobs: a toy MIMO model trained end to end on spawned gloo
worlds and checked against the undistributed model (``python -m mimo_fx.jobs``).

They use the library as a user does -- the op, its bridges, the MIMO layer -- and are
not part of it: :mod:`.toy` (the model), :mod:`.e2e` (the colocated, pipelined and
variable-length variants and the command line), :mod:`.pp_1f1b` (Megatron's 1F1B over
pipelined bridges), :mod:`.packed` (packed sequences with image tokens),
:mod:`.balanced` (images and sequences placed by cost every step), :mod:`.report` (the
per-step table).
"""
