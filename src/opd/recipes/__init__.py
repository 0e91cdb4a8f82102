"""The programs behind the commands: one module per command (`config → setup → run → cleanup`), each owning its
command's config class. This is the top layer of the package: recipes may import every component, and no component
imports a recipe (torchtune's `recipes/` beside `torchtune/`)."""
