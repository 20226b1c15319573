"""Code generation: KernelPlan -> CUDA C through Jinja2, and nvcc for PTX, cubins and ptxas reports."""
