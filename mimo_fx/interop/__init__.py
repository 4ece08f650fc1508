"""Interop with PyTorch's own distributed types: :mod:`.dtensor` moves DTensors between
meshes with mimo_fx plans and converts meshes and placements to layouts and back."""
