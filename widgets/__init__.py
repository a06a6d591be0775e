"""The notebook views' front-end sources: one ESM per view (``render`` draws the model's state into its element
and returns its cleanup) and the stylesheet they share.

The wheel installs this folder as the package ``ds4lab.widgets`` (``package-dir`` in pyproject.toml); the views
find it through :func:`ds4lab.viz.base.widgets_dir`, in a wheel, an editable install or a source checkout."""
