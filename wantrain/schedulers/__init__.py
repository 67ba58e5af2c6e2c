"""wantrain.schedulers"""
