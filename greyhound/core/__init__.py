"""Pure algorithm cores: numpy in, dataclasses out; never import nats, sqlalchemy or fastapi."""
