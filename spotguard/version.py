"""The package version, in a module of its own: modules that record it (commit records, status replies)
import it from here, not from the package root, whose lazy attributes import the hook."""

__version__ = "0.1.0"
