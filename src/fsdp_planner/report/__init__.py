"""Pictures of a simulated step: the data behind them (``step_view``) and its PNG and HTML renderings."""
