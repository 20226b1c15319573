"""The front end: spec text -> syntax tree (Lark) -> checked KernelSpec or SpecSpace, with file:line:col errors."""
