"""wantrain.models.wan22"""
