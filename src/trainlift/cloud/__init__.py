"""Cloud APIs: all boto3 calls (aws.py) and the pure capacity verdict (capacity.py)."""
