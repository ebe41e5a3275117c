"""``rollout_engine="graph"``: the engine (:mod:`.engine`, :class:`GraphRollout`), its decode loop replaying one CUDA
graph per step (:mod:`.generate`, :func:`graph_generate`) and its split-KV decode attention (:mod:`.attention`).

Importing :mod:`.generate` alone does not import trl (the benchmarks use it outside a trainer).
"""
