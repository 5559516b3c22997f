"""Meshes and partition specs: how the model and its state are laid out over devices."""
