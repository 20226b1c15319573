"""Lowering: (spec, layout, graph) -> KernelPlan, one module per family."""
