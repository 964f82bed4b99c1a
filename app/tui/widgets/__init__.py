"""Widgets of the terminal app, by area: transcript, prompt, dashboard, heatmap, tuning."""
