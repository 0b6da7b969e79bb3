"""The controller's HTTP side: the Litestar app, its keys, errors and OpenAPI."""
