"""``python -m examples.train``: the main job (what ``hatch run train`` runs)."""

from examples.train.main import main

main()
