"""Applications built on the packages (not installed with them): ``examples.train`` is the
main job that ``hatch run train`` runs."""
