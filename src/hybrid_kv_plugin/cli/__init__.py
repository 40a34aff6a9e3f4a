"""The ``hybrid-kv`` command line."""
