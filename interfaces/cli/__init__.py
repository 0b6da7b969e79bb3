"""``dacp``: the controller's command line."""
