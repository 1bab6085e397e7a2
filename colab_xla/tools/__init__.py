"""Developer tools of colab_xla (not needed in a notebook)."""
