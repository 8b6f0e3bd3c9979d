"""Performance targets, measured as ratios/percentiles against baselines in the same run (`make bench`)."""
