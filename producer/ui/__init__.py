"""The run dashboard: ``dflash-pipeline ui [--host 127.0.0.1] [--port 8700]``.

command.py (the CLI command), server.py (the aiohttp app and its JSON API), views.py (what
each panel shows), series.py (history from storage), static/ (plain HTML/CSS/JS and uPlot).
"""
