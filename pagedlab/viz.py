"""`from pagedlab import viz` as before: the drawings live in the course, pagedlab.course.viz (this
name is that module)."""
import sys

from .course import viz

sys.modules[__name__] = viz
