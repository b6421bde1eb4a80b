"""Partition: the traced graph as a cost graph cut into K balanced convex stages, under
device speeds and memory budgets, with the fewest bytes between them."""
