"""The version, in a module of its own: modules that stamp it into reports import it from here,
never from the package above them."""

__version__ = "0.1.0"
