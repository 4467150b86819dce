"""Backends: what a model's ops run on, chosen once per engine. The backend objects, the CPU's
features read at run time, the C++ kernels (csrc/) and their build, and the weight layouts the
kernels read. Nothing here imports the model or the step execution above it."""
