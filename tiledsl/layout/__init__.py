"""The layout pass: every size of a kernel from its spec and the device limits, by the family's layout
function (one module per family; the shared pieces in base.py; the dense-tile model of configs no template
builds in model.py). families.layout_of picks the function from the family table."""
