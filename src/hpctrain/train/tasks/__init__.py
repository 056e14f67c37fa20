"""The built-in tasks, one file each: `image_classification`, `segmentation`."""
