"""`megazoo verify RECIPE`: the recipe's own parallel features, shrunk, held to one process in fp64."""
