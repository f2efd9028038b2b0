"""Engine integrations. Importing this package changes nothing; each integration has an explicit ``attach``."""
