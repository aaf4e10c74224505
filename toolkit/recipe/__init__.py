"""Recipes: the typed schema, loading with base/overrides/presets, and the rules checked before a run."""
from toolkit.recipe.checks import Plan, check_paths, resolve
from toolkit.recipe.loader import find_recipe, list_recipes, load_recipe
from toolkit.recipe.schema import Recipe

__all__ = ["Plan", "Recipe", "check_paths", "find_recipe", "list_recipes", "load_recipe", "resolve"]
