"""A real model's KV-cache geometry as the installed wheel resolves it (``hybrid-kv doctor`` / ``replay``).

Below ``cli/`` and ``sim/``, above ``registration``: it imports neither the simulator nor any
feature, so ``doctor`` resolves a geometry without the simulator. ``geometry`` resolves,
``refusals`` words vLLM's refusals, ``inspection`` runs vLLM's model inspection here without
torchvision, ``unit_grid`` lists the prefix-match units a geometry allows, ``unit_advice``
names the finest one vLLM accepts, ``kv_plan`` is the wheel's KV-cache planning (shared with
``sim``), ``environment`` keeps vLLM offline.
"""
