-- What completed outputs carry for playback (SPEC 14), as their results said it: each output's HLS media playlist
-- (the master playlist is made of them), and the video's poster and storyboard (made with one output, its lowest).
-- Kept as the carried models' JSON (shared/media/playback.py), read back tolerantly. Expand only: the release before
-- ignores both tables and still runs on this schema (its outputs simply have no row here).
CREATE TABLE output_hls (
    video_id text  NOT NULL,
    height   int   NOT NULL,
    attempt  int   NOT NULL,  -- the attempt that made it: its files are under that attempt's prefix
    hls      jsonb NOT NULL,
    PRIMARY KEY (video_id, height),
    FOREIGN KEY (video_id, height) REFERENCES outputs ON DELETE CASCADE
);

CREATE TABLE video_artwork (
    video_id text  PRIMARY KEY REFERENCES videos ON DELETE CASCADE,
    height   int   NOT NULL,  -- the output whose job made it
    attempt  int   NOT NULL,
    artwork  jsonb NOT NULL
);
