"""The composition root: the greyhound command, and what runs the library and the services together."""
