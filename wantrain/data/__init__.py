"""wantrain.data"""
