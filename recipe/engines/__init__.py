"""Generation and training engines behind two narrow interfaces (see `recipe.engines.base`)."""
