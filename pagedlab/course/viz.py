"""Every drawing of the course under one name, as the notebooks use them (`viz.draw_timeline(...)`):
trace_views.py (pictures of a recorded engine Trace), explorer.py (the trace explorer),
charts.py (charts of numbers), style.py (colours and the house style)."""
from .charts import (draw_bandwidth, draw_bars, draw_fragmentation, draw_lines, draw_overlap,  # noqa: F401
                     draw_rope_wavelengths, draw_safetensors_layout, overlap_schedule)
from .explorer import (EXPLORER_DPI, EXPLORER_MAX_EVENT_FRAMES, EXPLORER_MAX_FRAMES, TraceExplorer,  # noqa: F401
                       event_steps, explore_trace, explorer_frames, explorer_html, widgets_available)
from .style import (CACHED, FREE, IDLE, MISSING, NUM_COLORS, PREEMPT, SHARED, fig_to_png, req_name,  # noqa: F401
                    request_color)
from .trace_views import (SMALL_POOL, STEP_FONT, StepPainter, draw_block_table, draw_pool,  # noqa: F401
                          draw_pool_usage, draw_step, draw_timeline, draw_timelines, draw_utilization,
                          pool_owners, preemption_marks, why_waiting)
