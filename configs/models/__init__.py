"""Model configs: one per row of the paper's tables at the 800M widths, and tiny variants."""
