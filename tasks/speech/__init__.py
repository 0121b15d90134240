"""Speech recognition with CTC on log-mel spectrograms: audio, the eSpeak NG corpus, features, the task."""
