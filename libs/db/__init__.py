"""Registry persistence: SQLAlchemy models, engines, migrations and queries."""
