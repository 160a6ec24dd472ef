"""Carnator's tiny world: a synthetic text-to-video world with known ground truth.

- :mod:`tinyworld.world`   scenes, rendering, captions/paraphrases, pair kinds
- :mod:`tinyworld.latent`  exact pixels <-> 16-channel latent (and ComfyUI LATENT space), coordinate frames
- :mod:`tinyworld.text`    all-MiniLM-L6-v2 text encoder -> (1, 32, 4096) conditioning
- :mod:`tinyworld.checker` reads shape/colour/position/motion back from a video
- :mod:`tinyworld.language` a broad phrasing of scenes in template families, training/held-out split

The model is trained by ``scripts/train_tinyworld.py``; weights in ``models/tinyworld/``.
Plain torch/numpy: nothing here imports ComfyUI.
"""
